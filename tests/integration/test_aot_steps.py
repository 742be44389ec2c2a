"""Decode steps compiled ahead of time by AOTInductor (serve/causal_lm/server/aot_steps.py), as the
package stage ships them and a worker loads them: rows joining a continuous batch that
decodes through them get the tokens their prompts get alone, with nothing compiled while
serving; the grouped kernel's int8 weights decode through them too; a worker whose model
lacks a weight the packages name refuses them in one line. (Integration tier: each export
compiles C++ for 20-40 s.)"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from batcher_checks import (
    CACHE,
    rows_joining_at_any_step_decode_their_tokens_alone,
    varied_model,
)

from serve import worker_temp
from serve.causal_lm.runtime.attention import attention, decode_attention_for
from serve.causal_lm.runtime.decode import StaticDecoder
from serve.causal_lm.runtime.kernels import grouped_mm_available
from serve.causal_lm.runtime.loading import quantize_weights
from serve.causal_lm.server import aot_steps, compiled_graphs
from serve.causal_lm.server.prefill import Prefiller
from serve.causal_lm.server.rows import Row


@pytest.fixture(scope="module")
def model():
    return varied_model()


@pytest.fixture(scope="module")
def shipped(model, tmp_path_factory):
    """The archive's compiled_graphs/ folder of `model`: packages for 1 and 2..4 rows, and
    the prefill's for 1..4."""
    folder = tmp_path_factory.mktemp("compiled_graphs")
    aot_steps.export_steps(model, 4, CACHE, "default", folder)
    aot_steps.export_prefill(model, 4, CACHE, "default", folder)
    (folder / compiled_graphs.TARGET).write_text(json.dumps(compiled_graphs.target()))
    return folder


def test_the_steps_read_the_workers_own_weights(shipped, model) -> None:
    """The packages hold no weights: they run on the model's tensors (no copy)."""
    # a float model's graph tells one row from more: a prefill for 1 row and one for 2-4
    assert sorted(p.name for p in shipped.glob("*.pt2")) == sorted([
        aot_steps.ONE, aot_steps.ROWS, aot_steps.PREFILL, aot_steps.PREFILL_ONE])
    steps = aot_steps.load_steps(shipped, model)
    decoder = aot_steps.use_step(StaticDecoder(model, CACHE, always_mask=True), steps[1])
    decoder.allocate(1)
    step = (torch.tensor([[5]]), 3, torch.tensor([[3]]), torch.ones(1, CACHE, dtype=torch.long))
    with torch.inference_mode():
        before = decoder.decode_step(*step).clone()
        model.lm_head.weight.mul_(2)
        try:
            after = decoder.decode_step(*step)
        finally:
            model.lm_head.weight.div_(2)
    assert before.abs().max() > 0 and torch.allclose(after, 2 * before, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not grouped_mm_available(), reason="the grouped kernel did not build")
def test_the_kernel_librarys_operators_run_a_package_as_the_binding_does(shipped,
                                                                         model) -> None:
    """Where the kernel library is loaded, a package runs through its operators
    (`package_runner.cpp`: the call lets go of the GIL): the same logits, bit for bit, and
    the same writes to the cache, as through torch._C._aoti's binding."""
    assert aot_steps.operators_loaded()
    steps = aot_steps.load_steps(shipped, model)
    assert type(steps[2].loader) is aot_steps.OperatorLoader
    with pytest.MonkeyPatch.context() as patch:  # the binding's path, as without the library
        patch.setattr(aot_steps, "operators_loaded", lambda: False)
        binding = aot_steps.load_package(shipped / aot_steps.ROWS, model)
    assert type(binding.loader) is not aot_steps.OperatorLoader
    got = {}
    for name, package in (("operators", steps[2]), ("binding", binding)):
        decoder = aot_steps.use_step(StaticDecoder(model, CACHE, always_mask=True), package)
        decoder.allocate(3, dynamic_rows=True)
        tokens = torch.tensor([[5], [9], [2]])
        with torch.inference_mode(), attention(model, decoder.attention):
            logits = decoder.decode_step(tokens, 3, torch.tensor([[3], [3], [3]]),
                                         torch.ones(3, CACHE, dtype=torch.long))
        got[name] = (logits.clone(), decoder.cache.layers[0].keys[:, :, 3].clone())
    assert got["operators"][0].abs().max() > 0
    assert all(torch.equal(a, b) for a, b in zip(got["operators"], got["binding"], strict=True))


def test_the_packages_extract_into_the_workers_own_folder(shipped, model) -> None:
    """AOTInductor's loader extracts a package (its C++ library) into TMPDIR as it is when
    the package loads: a worker's extractions lie in its own folder (serve/worker_temp.py),
    which the next worker removes where this one was killed (tests/unit/test_worker_temp.py)."""
    before = set(worker_temp.folder().iterdir())
    steps = aot_steps.load_steps(shipped, model)
    extracted = set(worker_temp.folder().iterdir()) - before
    assert sorted(steps) == [1, 2] and len(extracted) == 2, extracted
    assert all(any(folder.rglob("*.so")) for folder in extracted), extracted


def test_rows_joining_a_batch_of_shipped_steps_decode_their_tokens_alone(
        shipped, model, monkeypatch) -> None:
    steps, prefill, said = compiled_graphs.use_shipped(shipped, model)
    assert said == "shipped decode steps and prefill loaded" and sorted(steps) == [1, 2]
    assert isinstance(prefill, aot_steps.LoadedPrefill)
    calls = []
    for fewest, package in list(prefill.packages.items()):
        prefill.packages[fewest] = lambda *a, run=package: (calls.append(a[0].shape),
                                                            run(*a))[1]
    # nothing compiles while serving (the check counts Dynamo's graphs)
    rows_joining_at_any_step_decode_their_tokens_alone(model, monkeypatch, steps=steps,
                                                       package=prefill)
    assert {shape[0] for shape in calls} >= {1, 2}, calls  # through both packages


def test_the_shipped_prefill_gives_the_eager_prefill_s_logits_for_any_rows(shipped,
                                                                          model) -> None:
    """The package takes 1 to 4 rows of 2 to `cache_len` positions, anywhere in the cache
    (a later chunk attends to the positions written before it): its last positions' logits
    are the eager prefill's to float32 rounding (Inductor fuses the norms), a lone row's
    those it gets in a batch (the same bits on the kernels: test_batch_invariance.py)."""
    prefill = aot_steps.LoadedPrefill(aot_steps.load_prefill(shipped, model), 4, True)
    generator = torch.Generator().manual_seed(3)
    for rows, lengths in ((1, [7]), (3, [2, 9, 30]), (4, [5, 5, 12, 63]), (2, [40, 3])):
        prompts = [torch.randint(1, 97, (n,), generator=generator).tolist() for n in lengths]
        got = {}
        for name, package in (("eager", None), ("shipped", prefill)):
            prefiller = Prefiller(model, CACHE, chunk=16, package=package)
            with torch.inference_mode(), attention(model, decode_attention_for(model)):
                job = prefiller.start([Row(ids, 1, lambda token, end: None) for ids in prompts])
                while not job.finished:  # in chunks of 16: a chunk after the first
                    prefiller.step(job, whole=False)
                got[name] = job.logits.clone()
                if name == "shipped":
                    lone = prefiller.start([Row(prompts[-1], 1, lambda token, end: None)])
                    prefiller.step(lone, whole=True)
                    torch.testing.assert_close(lone.logits[0], job.logits[-1])
        assert got["shipped"].shape == (rows, 97)
        torch.testing.assert_close(got["shipped"], got["eager"], rtol=1e-4, atol=1e-4)


def test_a_model_lacking_a_weight_the_packages_name_refuses_them(shipped, caplog) -> None:
    other = varied_model()
    del other.model.layers[1]  # the second layer's weights are gone
    with caplog.at_level(logging.WARNING):
        steps, prefill, said = compiled_graphs.use_shipped(shipped, other)
    assert steps == {} and prefill is None and said == "shipped steps refused: compiling afresh"
    [line] = [r.getMessage() for r in caplog.records]
    assert "needs weights the model lacks" in line and "layers.1." in line


@pytest.mark.skipif(not grouped_mm_available(), reason="the grouped kernel did not build")
@pytest.mark.parametrize("activations", ["float32", "int8", "bf16"])
def test_int8_grouped_weights_decode_their_eager_tokens_through_a_shipped_step(
        tmp_path, activations) -> None:
    """Float32 activations, and the opt-in int8 and bf16 modes, whose 2-row steps call
    their own operators (`grouped_mm_int8`, `grouped_mm_bf16`) through the package's proxy
    executor."""
    model = varied_model()
    quantize_weights(model, "int8_grouped", 32, activations=activations)
    prompts = [[5, 17, 3, 9], [8, 2, 44, 61, 7]]
    want = StaticDecoder(model, CACHE, always_mask=True).generate(prompts, 12).rows
    aot_steps.export_steps(model, 2, CACHE, "default", tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.pt2")) == [aot_steps.ONE, aot_steps.ROWS]
    steps = aot_steps.load_steps(tmp_path, model)
    for rows, batch in ((2, prompts), (1, prompts[:1])):
        decoder = aot_steps.use_step(StaticDecoder(model, CACHE, always_mask=True),
                                     steps[rows])
        with torch.inference_mode():
            assert decoder.generate(batch, 12).rows == want[:rows]


@pytest.mark.skipif(not grouped_mm_available(), reason="the grouped kernel did not build")
def test_a_moe_step_autotuned_at_max_loads_with_the_model_s_own_weights(tmp_path) -> None:
    """max-autotune's C++ GEMM template once packed each float router's weight into a
    constant of its own, which no worker could hand over: the MoE package (what
    `decode_compile: max-autotune` ships for llm_moe) refused to load."""
    from moe_models import tiny_moe

    model, _ = tiny_moe("mixtral")
    quantize_weights(model, "int8_grouped", 32)
    want = StaticDecoder(model, CACHE, always_mask=True).generate([[5, 17, 3, 9]], 8).rows
    aot_steps.export_steps(model, 1, CACHE, "max-autotune", tmp_path)
    steps = aot_steps.load_steps(tmp_path, model)
    decoder = aot_steps.use_step(StaticDecoder(model, CACHE, always_mask=True), steps[1])
    with torch.inference_mode():
        assert decoder.generate([[5, 17, 3, 9]], 8).rows == want
