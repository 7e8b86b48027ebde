"""The parts ParallelModule (nnscaler.runtime.module) is made of: its gradient side, end-to-end
train/infer steps, nnScaler 0.8 compatible members, input-shape checks, constants loading,
meta-device weights and replica construction."""
