import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tests that expect a deployment to fail leave Pulumi's failed registration futures behind; asyncio
# reports each one again ("Future exception was never retrieved") when it is collected, long after
# the test asserted the error. Keep CI output to what matters.
logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def pytest_terminal_summary(terminalreporter):
    """Per test file: the seconds its tests took (setup, call and teardown together), slowest first;
    with several processes the files overlap, so the total is more than the run's wall time."""
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            duration, nodeid = getattr(report, "duration", None), getattr(report, "nodeid", "")
            if duration is not None and "::" in nodeid and getattr(report, "when", None):
                module = nodeid.split("::", 1)[0]
                totals[module] = totals.get(module, 0.0) + duration
    if not totals:
        return
    terminalreporter.write_sep("=", "seconds per test file")
    for module, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s  {module}")
