"""The `compress` command line: thin click commands over the library."""
