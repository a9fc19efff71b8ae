"""Helpers shared by the test areas: real parts, plus the few fakes for faults a real
part cannot produce on demand (each an implementation of one of our interfaces)."""
