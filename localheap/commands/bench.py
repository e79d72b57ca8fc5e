"""`localheap bench` (placeholder until its issue lands)."""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="not available yet")
    p.set_defaults(func=run)


def run(args) -> int:
    raise ValueError("localheap bench is not implemented yet")
