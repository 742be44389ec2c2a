"""TorchServe's metrics configuration for a compress server: TorchServe's own metrics (its
package's `metrics.yaml`) and those compress's handlers report (`serve.handler_metrics`), all
exposed in Prometheus format on the server's metrics port (`metrics_mode=prometheus`)."""

from __future__ import annotations

from pathlib import Path

import yaml

from serve.handler_metrics import DIMENSION, METRICS


def write_metrics_config(path: Path) -> Path:
    """Write the metrics configuration to `path`; its path."""
    import ts

    base = yaml.safe_load((Path(ts.__file__).parent / "configs" / "metrics.yaml").read_text())
    model = base.setdefault("model_metrics", {})
    for name, (unit, kind) in METRICS.items():
        model.setdefault(kind, []).append({"name": name, "unit": unit,
                                           "dimensions": [DIMENSION]})
    path.write_text(yaml.safe_dump(base, sort_keys=False))
    return path


def metrics_url(port: int) -> str:
    return f"http://127.0.0.1:{port}/metrics"
