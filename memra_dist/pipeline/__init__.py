"""The ppN split: pure partitioning, torch.distributed transport, Ray stage / head actors,
and the driver that places them and streams tokens back."""
