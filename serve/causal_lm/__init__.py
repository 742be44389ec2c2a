"""The causal-LM family's code: `runtime/`, what an export folder ships (as the top-level
package `causal_lm`, beside the weights), and `server/`, what an archive adds (the archive
ships both, as `serve/causal_lm/`). The folders are the list of what ships: the export and
package stages copy them whole. Nothing is imported here.
"""
