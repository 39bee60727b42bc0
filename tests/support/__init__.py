"""Test-only support (not in the wheel): ``mlx_lm.server`` as a subprocess on loopback
(``server``), a request load with shared and diverging prefixes (``server_load``), cold reference
answers of chat requests (``chat_reference``), and an MTP draft with controlled acceptance
(``mtp_drafts``). Benchmarks import it with ``tests/`` on ``sys.path``."""
