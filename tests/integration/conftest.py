"""The vLLM glue's unit tests (tests/integration/vllm/): they run with or without vLLM installed.

pytest puts this folder on sys.path (rootdir-relative imports, no __init__.py), where the folder
tests/integration/vllm would be found as a namespace package named `vllm` when vLLM is not
installed: then `import vllm` is made to fail instead, so that `pytest.importorskip("vllm")`
skips the tests that need it (test_pd.py, test_connector.py) and none of them sees that folder.
The end-to-end tests and their fixtures are in tests/e2e/.
"""

import sys

try:
    import vllm
except ImportError:
    vllm = None
if vllm is not None and getattr(vllm, "__file__", None) is None:
    # Not vLLM: the folder tests/integration/vllm (no __init__.py) found as a namespace package.
    vllm = None
if vllm is None:
    sys.modules["vllm"] = None  # every later `import vllm` fails (importorskip skips), none finds that folder
