"""Phase semantics: trace levels, the phase clock, records, the round log, the stderr lines."""
