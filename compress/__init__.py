"""compress: a model compression and deployment pipeline driven by YAML recipes."""

__version__ = "0.1.0"
