"""benchmarks/embedding/mteb_agreement.py without a server: the table puts each model's
scores under its task, in the tasks' order, and a folder that is no finished run is one
error line (exit 2)."""

from __future__ import annotations

from benchmarks.embedding.mteb_agreement import TASKS, main, table


def test_the_table_keeps_the_tasks_order_and_marks_a_missing_score() -> None:
    rows = [("baseline", {"mteb_SST2KnownItemRetrieval_ndcg_at_10": 0.633314,
                          "mteb_SST2LocalClassification_accuracy": 0.706078}),
            ("folder", {"mteb_SST2LocalClassification_accuracy": 0.7})]
    lines = table(rows, list(TASKS))
    assert lines[0] == ("| model | SST2LocalClassification_accuracy | "
                        "SST2KnownItemRetrieval_ndcg_at_10 |")
    assert lines[2] == "| baseline | 0.706078 | 0.633314 |"
    assert lines[3] == "| folder | 0.700000 | - |"


def test_a_folder_that_is_no_run_is_one_line(tmp_path, capsys) -> None:
    assert main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "no such folder" in err[0]
