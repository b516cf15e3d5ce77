"""Process plumbing every process of the engine shares (a leaf: imports nothing else of the
project but config/): starting a child module and naming it, watching a parent or a peer die,
stop orders (ipc/process.py); the ROUTER server / DEALER client socket pair with its CurveZMQ
security (ipc/sockets.py, ipc/curve.py); the HELLO/READY handshake (ipc/handshake.py)."""
