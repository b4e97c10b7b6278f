"""One module per stage. Each reads like a paragraph: inputs, the engine call, metadata, checks."""
