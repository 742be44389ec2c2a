"""The embedding family (sentence-transformers models): `encoder.py` reads a
sentence-transformers folder as one torch module, `measures.py` scores embeddings against
the float model's (fidelity, retrieval agreement) and the labels (k-NN accuracy)."""
