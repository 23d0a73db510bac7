"""Tracing: the name registry, the OTel provider and exporters, records -> spans."""
