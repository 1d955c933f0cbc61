"""Commands and helpers around the library: the CLI, demos, the model builder, testing helpers."""
