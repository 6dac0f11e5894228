"""What steers calls from outside any one of them: agreements across ranks
that never make a call wait (agreement), and on them the learned deadline
(deadline) and code (redundancy); the watch for a rank that fell behind its
peers (lag); ranks that MPI reports as failed (failures).  Internal."""
