"""Classifier peers: a finished run's artifacts against Hugging Face Optimum and OpenVINO on
the same fine-tuned model (`peers`), and two files timed with nothing but their runtime
(`plain_pair`)."""
