//! The host's RAM from `/proc/meminfo`.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostMemory {
    pub total_bytes: u64,
    pub available_bytes: u64,
}

pub fn host_memory() -> Option<HostMemory> {
    parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

pub fn parse_meminfo(text: &str) -> Option<HostMemory> {
    let total = super::procfs::status_field_bytes(text, "MemTotal")?;
    let available = super::procfs::status_field_bytes(text, "MemAvailable")?;
    Some(HostMemory { total_bytes: total, available_bytes: available })
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_real_meminfo() {
        let m = super::host_memory().unwrap();
        assert!(m.total_bytes >= m.available_bytes && m.available_bytes > 0);
    }
}
