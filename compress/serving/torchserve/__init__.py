"""compress's first serving engine, TorchServe (a Java frontend and Python workers), serving
an unpacked `.mar`.

- `launch`: the host side, what `compress serve` runs: write `config.properties`, start
  TorchServe in the background with its own TMPDIR, wait until a worker of the model is
  READY, record it in server.json.
"""
