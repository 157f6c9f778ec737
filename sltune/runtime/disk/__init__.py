"""The disk tier: the master weights, the optimizer state and the dtype weights in files under offload_dir
(optimizer_offload and param_offload disk). The engine's own folder (`folder`), the files it writes with O_DIRECT
(`direct_io`) durably (`durable`) and checksums (`checksum`), a block's layout (`layout`), the I/O pump of the
optimizer's blocks (`state`) apart from their format on disk (`files`), the weights' files (`weightfiles`), the
window of gradients (`gradwindow`), and the manifest every folder of files keeps, shared with the checkpoints
(`manifest`)."""
