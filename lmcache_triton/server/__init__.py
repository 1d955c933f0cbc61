"""The cache server (`lm://`) process and its wire format, shared with the client in storage.remote."""
