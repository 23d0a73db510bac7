"""The seed's phase semantics: levels + env, the phase clock, records, round log, lines."""
