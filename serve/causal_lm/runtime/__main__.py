"""`python -m causal_lm.runtime FOLDER PROMPT`: print what a causal-LM folder generates."""

from .loading import main

main()
