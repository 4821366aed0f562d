"""What several test folders share: an ASGI app served on a loopback port in a thread
(``asgi_server``), the real data directory and the skip without it (``data_dir``), the vLLM
test bed's model and workload sizing (``vllm_workload``), and notebook execution on this
interpreter (``notebooks``).

Each module imports only what its own job needs: ``data_dir`` stays within the standard library
and pytest because ``tests/conftest.py`` (loaded by every tier, the sglang tier's environment
too) uses it.
"""
