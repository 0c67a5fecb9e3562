"""The pieces of bench/ipc_wakeup.py (the wake-up comparison behind the data plane's semaphores).

common.py    names, time budgets, the liveness check and the sweep of stale objects
channels.py  one wake-up channel per mechanism (semaphores, ZeroMQ, FIFOs, spinning, iceoryx2)
pingpong.py  the peer process, the timed ping-pong and the kill -9 check
"""
