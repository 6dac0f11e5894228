"""What steers calls from outside any one of them: the MPILOSSY_* settings
(settings), the learned, agreed deadline (deadline) and code (redundancy),
and the watch for a rank that fell behind its peers (lag).  Internal."""
