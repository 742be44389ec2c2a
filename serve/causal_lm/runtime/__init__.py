"""The causal-LM runtime: what a causal-LM export folder ships as its `causal_lm/runtime/`
package (torch, transformers and torchao only; nothing from compress), and what an archive's
server runs on. Its modules import each other relatively, so the package works as
`serve.causal_lm.runtime` here, `causal_lm.runtime` in an export folder and
`serve.causal_lm.runtime` in an archive. From an export folder:

    python -m causal_lm.runtime . "What is the capital of France?" --max-new-tokens 32

or in Python, `from causal_lm.runtime import load_folder, StaticDecoder`.
"""

from .loading import LoadedCausalLM, Sampling, StaticDecoder, load_folder, prompt_ids, stop_ids

__all__ = ["LoadedCausalLM", "Sampling", "StaticDecoder", "load_folder", "prompt_ids", "stop_ids"]
