"""What users run: the command line, the demo, image outputs, and the client that queues workflows on ComfyUI servers
(one workflow, or a batch over several servers)."""
