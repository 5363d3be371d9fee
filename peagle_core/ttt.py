"""EAGLE-3 training-time test (placeholder until the TTT objective lands)."""
