"""Every message type that crosses a process or layer boundary: sampling parameters, the engine
core's requests and outputs, the scheduler's step and the runner's output, the tokenizer
process's messages, and the array frames they travel with. A leaf: imports nothing else from
the project, so every process may import it (docs/protocol.md)."""
