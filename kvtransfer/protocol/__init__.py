"""The transfer protocol every backend speaks: one control connection per (sender, receiver) pair
(wire.py: frames, metadata; handshake.py: hello and proof), the room tables on both sides
(receiver.py, sender.py), page-run merging and scatter/gather IO (runs.py, iovec.py), and the two data
paths the protocol carries itself: shm (same host, P copies into D's mapped pool) and tcp (pages on
the control connection). Other data paths plug in from kvtransfer/backends/."""
