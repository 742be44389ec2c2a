"""The classifier family's server: the batching handler a classifier archive ships (as
`serve/classifier/`, beside the shared serving modules). Nothing is imported here."""
