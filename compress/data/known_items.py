"""Known-item queries: a retrieval set made from plain sentences, for when no labelled
retrieval data is at hand (these machines have only SST-2). A sentence of at least
`MIN_WORDS` words gives a query, `QUERY_WORDS` consecutive words of it from its middle
third, whose one relevant document is the sentence itself. The reranker's pairs and the
embedding family's MTEB retrieval task both read them."""

from __future__ import annotations

QUERY_WORDS = 4
MIN_WORDS = 6


def known_item_query(sentence: str) -> str | None:
    """The query that finds `sentence` (None: too short to give one)."""
    tokens = sentence.split()
    if len(tokens) < MIN_WORDS:
        return None
    start = len(tokens) // 3
    return " ".join(tokens[start:start + QUERY_WORDS])


def known_item_queries(sentences: list[str]) -> list[tuple[str, int]]:
    """Each distinct known-item query of `sentences` with the index of the sentence it came
    from, in order (a query that an earlier sentence gave too is left out)."""
    out, seen = [], set()
    for i, sentence in enumerate(sentences):
        query = known_item_query(sentence)
        if query is not None and query not in seen:
            seen.add(query)
            out.append((query, i))
    return out
