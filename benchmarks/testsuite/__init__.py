"""Where the test suite's time goes: its CPU by process (`cpu_by_process`)."""
