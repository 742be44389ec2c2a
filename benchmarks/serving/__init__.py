"""The serving engines side by side: one archive served by TorchServe, LitServe and Ray
Serve (1 and 2 replicas) on this machine, in one invocation (`engines`, `table`)."""
