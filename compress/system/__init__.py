"""What compress reads of the machine it runs on, below every other sub-package (no torch):
its processes (`processes`)."""
