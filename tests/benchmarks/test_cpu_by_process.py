"""benchmarks/testsuite/cpu_by_process.py: processes summed by kind, a compiler charged to
its first ancestor that is not one."""

from __future__ import annotations

from benchmarks.testsuite.cpu_by_process import kinds, python_kind


def row(pid: int, ppid: int, start: float, cpu: float, name: str, command: str) -> dict:
    return {"pid": pid, "ppid": ppid, "start": start, "cpu_s": cpu, "name": name,
            "command": command}


def test_compilers_go_to_the_build_or_the_python_process_that_ran_them() -> None:
    worker = "python -u -c import sys;exec(eval(sys.stdin.readline()))"
    rows = [
        row(10, 1, 0.0, 30.0, "python", worker),
        row(11, 10, 1.0, 2.0, "ninja", "ninja -v"),
        row(12, 11, 1.5, 0.1, "g++", "g++ -c library.cpp"),
        row(13, 12, 1.6, 60.0, "cc1plus", "cc1plus library.cpp"),
        row(20, 10, 5.0, 8.0, "python", "python -m compress run r.yaml"),
        row(21, 20, 6.0, 20.0, "cc1plus", "cc1plus wrapper.cpp"),
        row(22, 1, 7.0, 4.0, "java", "java -cp ts"),
        # pid 11 used again later by a process of another kind: charged by start time
        row(11, 20, 9.0, 1.0, "g++", "g++ kernel.cpp"),
    ]
    assert kinds(rows) == {
        "pytest-xdist worker (tests in process)": 30.0,
        "compiler under ninja (kernel library builds)": 62.1,
        "compress run": 8.0,
        "compiler under compress run": 21.0,
        "java (TorchServe)": 4.0,
    }


def test_python_processes_are_named_by_their_command() -> None:
    assert python_kind("python -m compress serve runs/x") == "compress serve"
    assert python_kind("python -m torch.distributed.run --nproc 2") == "torch.distributed.run"
    assert python_kind("python -m something else here") == "python: -m something"
