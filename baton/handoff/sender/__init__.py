"""The hand-off's sender child process (settings.handoff_sender = "process").

process.SenderProcess   the parent's handle: starts the child, hands it pushes
stream.ProcessPush      one LoadState call as the parent sees it: its stager thread copies the
                        state into the shared ring
ipc                     the control messages and the shared-memory ring (both sides; no torch)
child                   the child: frames chunks out of the ring, hashes them, streams LoadState
"""
