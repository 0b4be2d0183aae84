"""Locally built test image for the end-to-end rehearsal (see build.py)."""
