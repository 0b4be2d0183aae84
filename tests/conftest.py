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
