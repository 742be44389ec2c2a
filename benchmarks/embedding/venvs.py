"""The peers' own virtual environments for benchmarks/embedding/peers.py and served.py, each
made once and reused (benchmarks/harness/venv.py, like the classifier's Optimum one).

pip cannot put sentence-transformers' two backends in one environment, nor its ONNX one
beside sentence-transformers 6: the `onnx` extra needs optimum-onnx (0.1.0 at most), which
pins transformers below 4.58 and optimum ~=2.1, while sentence-transformers 6 needs
transformers 5 and optimum-intel 2.2 optimum ~=2.3. So there are three: `onnx` (the newest
sentence-transformers below 6 with its ONNX Runtime backend, and fastembed), `openvino`
(sentence-transformers 6.2.0 with OpenVINO and NNCF) and `infinity` (infinity-emb's server,
which pins sentence-transformers below 4 and numpy below 2, with optimum 1.26.1 so that its
own ONNX optimization works; see INFINITY_PINS). Each is `python -m venv`, then
`pip install torch==2.13.0` (the CPU wheel pip finds here), then its packages with torch
held at that version (`-c`: optimum-intel's torchvision would otherwise bring torch 2.14's
CUDA build), then a few removed (see OPENVINO); pip's output goes to `<venv>.log`, and a
marker written after the last step, holding the packages' versions, tells a finished
environment from a half-made one (which is installed into again: pip keeps what is
already there).
"""

from __future__ import annotations

from benchmarks.harness.venv import Venv

READY = ".compress-embed-peer-ready"
TORCH = "torch==2.13.0"  # first, and held, so that the packages after it keep the CPU wheel

ONNX = Venv("onnx", "~/.cache/compress/embed-onnx-venv", READY,
            ((TORCH,), ("sentence-transformers[onnx]<6", "fastembed==0.9.1")),
            variable="COMPRESS_EMBED_ONNX_VENV", prefix="peers_embed", hold=True, reuse=True,
            facts=("sentence-transformers", "optimum-onnx", "optimum", "onnxruntime",
                   "fastembed", "transformers", "torch"))
OPENVINO = Venv("openvino", "~/.cache/compress/embed-openvino-venv", READY,
                ((TORCH,), ("sentence-transformers[openvino]==6.2.0",
                            "optimum-intel[openvino]==2.2.0",
                            "datasets")),  # datasets: the calibration split; without the pin
                # pip takes optimum-intel 2.0 to fit the newest datasets
                variable="COMPRESS_EMBED_OPENVINO_VENV", prefix="peers_embed", hold=True,
                reuse=True,
                facts=("sentence-transformers", "optimum-intel", "optimum", "openvino", "nncf",
                       "transformers", "torch"),
                # the index's torchvision is built for CUDA torch: with the CPU wheel its
                # ops do not register, and transformers' AutoProcessor import fails on it
                remove=("torchvision",))
# infinity-emb 0.0.78 optimizes an ONNX file itself (optimum's ORTOptimizer with
# `OptimizationConfig(optimize_with_onnxruntime_only=...)`), which only optimum 1.x has:
# unpinned, pip takes optimum 2.1 with optimum-onnx 0.1, whose OptimizationConfig lost that
# argument, and infinity serves the file unoptimized. optimum 1.26.1 is the newest 1.x whose
# exporter still imports on torch 2.13 (1.27.0 imports torch.onnx's removed
# `_attention_scale`); its BetterTransformer, imported by infinity, needs transformers below
# 4.49; its `datasets` would bring a pyarrow that needs numpy 2, which infinity forbids.
INFINITY_PINS = ("infinity-emb[server,torch,optimum]==0.0.78", "optimum[onnxruntime]==1.26.1",
                 "transformers<4.49", "numpy<2", "pyarrow<20")
INFINITY = Venv("infinity", "~/.cache/compress/infinity-venv", READY,
                ((TORCH,), INFINITY_PINS),
                variable="COMPRESS_INFINITY_VENV", prefix="peers_embed", hold=True,
                pinned=True,  # an environment made from an older list is made again
                facts=("infinity-emb", "sentence-transformers", "optimum", "onnxruntime",
                       "transformers", "torch"))
