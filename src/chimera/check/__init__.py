"""Checks before and during a run: the communication plan, the rendezvous, validation of a schedule."""
