"""One module per CLI command: add_parser(subparsers) and the function it runs."""
