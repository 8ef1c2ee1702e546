"""``dualpath de_loader ...`` (tools.cli COMMANDS entry)."""

from tools.cluster.node_runner import main_for


def main(argv: list[str] | None = None) -> int:
    return main_for("de_loader", argv)
