//! torchmem's recording engine, used by `torchmem run` (the CLI holds only its arguments):
//!
//! - `launch`: how a program, script or module becomes a command line and starts (the interpreter, PATH, the
//!   injected `sitecustomize`, `PYTHONPATH`, the exit code), shared with `torchmem estimate`;
//! - `session`: a recording run: the launch, the loop (samples, signals, a terminal overlay), the end;
//! - `recorder`: the sampling loop over the program's process tree (CPU, NVML, PyTorch's allocator through
//!   the event socket), producing `torchmem_core::record::Record`s;
//! - `sinks`: where the records go (the SQLite profile, Prometheus, TensorBoard, the live state file);
//! - `live_state`: the records folded into a run's latest readings (`LiveState`, `LiveSnapshot`), the one
//!   live state behind `torchmem top`'s state file, `run --live`, `run --status` and the Prometheus gauges
//!   (`LiveHandle`: shared, folded once per batch by `sinks::Sinks`);
//! - `signals`: the supervisor that forwards signals to the program and reports how it ended;
//! - `oom_watch`: the kernel OOM killer's verdicts on the tree;
//! - `output_path`: where commands write, checked before anything is created or replaced.

pub mod launch;
pub mod live_state;
pub mod oom_watch;
pub mod output_path;
pub mod recorder;
pub mod session;
pub mod signals;
pub mod sinks;
