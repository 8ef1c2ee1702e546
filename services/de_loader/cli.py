"""``dualpath de_loader ...`` (common.cli COMMANDS entry)."""

from services.pe_receiver.runner import main_for


def main(argv: list[str] | None = None) -> int:
    return main_for("de_loader", argv)
