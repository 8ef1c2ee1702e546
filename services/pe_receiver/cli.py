"""``dualpath pe_receiver ...`` (tools.cli COMMANDS entry)."""

from tools.cluster.node_runner import main_for


def main(argv: list[str] | None = None) -> int:
    return main_for("pe_receiver", argv)
