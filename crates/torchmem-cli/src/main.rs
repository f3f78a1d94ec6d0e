//! The standalone `torchmem` binary: everything lives in the library so the Python wheel can run the same code.

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    std::process::exit(torchmem_cli::run(args));
}
