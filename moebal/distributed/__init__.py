"""Process groups, expert parallelism and collectives: the runtime under every parallel mode."""
