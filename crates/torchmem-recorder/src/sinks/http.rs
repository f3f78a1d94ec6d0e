//! A tiny HTTP/1.1 server for `/metrics` on `std::net::TcpListener`, in its own thread (no async runtime):
//! one request per connection, answered and closed; `GET /metrics` (Prometheus text, or OpenMetrics when
//! the scraper's `Accept` asks for it), `GET /` (a pointer to /metrics), 404 otherwise. A slow or silent
//! client is dropped after a short timeout, and the recorder never waits on a scrape.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// A `--metrics` value: `HOST:PORT`, `[IPv6]:PORT`, or `:PORT` (127.0.0.1). Checked before the program
/// runs (a usage error); the host is resolved when the server binds.
pub fn parse_listen_address(value: &str) -> Result<String, String> {
    let hint = "expected HOST:PORT, e.g. --metrics 127.0.0.1:9464, --metrics :9464 (127.0.0.1) or \
                --metrics 0.0.0.0:9464 (every interface); port 0 picks a free one";
    let Some((host, port)) = value.rsplit_once(':') else {
        return Err(format!("no port in '{value}': {hint}"));
    };
    if port.parse::<u16>().is_err() {
        return Err(format!("'{port}' is not a port number (0-65535): {hint}"));
    }
    let host = if host.is_empty() { "127.0.0.1" } else { host };
    Ok(format!("{host}:{port}"))
}

/// `--metrics HOST:PORT` plus `by` (`--metrics-port-offset local-rank`: one port per rank on a node).
/// Port 0 (any free one) stays 0; a sum past 65535 is an error naming both numbers.
pub fn offset_port(address: &str, by: u32) -> anyhow::Result<String> {
    let (host, port) = address.rsplit_once(':').ok_or_else(|| anyhow::anyhow!("no port in '{address}'"))?;
    let port: u32 = port.parse()?;
    if port == 0 {
        return Ok(address.to_string());
    }
    match u16::try_from(port + by) {
        Ok(p) => Ok(format!("{host}:{p}")),
        Err(_) => anyhow::bail!(
            "--metrics {address} with --metrics-port-offset: port {port} + local rank {by} is past 65535. Pick a lower port"
        ),
    }
}

/// The error of a port another program holds (so a recorder inside a distributed launch can take a free
/// port instead of ending its rank, and the job).
#[derive(Debug)]
pub struct PortInUse(pub String);

impl std::fmt::Display for PortInUse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PortInUse {}

/// What the server answers with: (body, content type) for `/metrics`, given whether the scraper accepts
/// OpenMetrics.
pub type Render = Arc<dyn Fn(bool) -> (String, &'static str) + Send + Sync>;

pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Binds `address` (from `parse_listen_address`) and serves from a new thread.
    pub fn start(address: &str, render: Render) -> anyhow::Result<Self> {
        let addrs: Vec<SocketAddr> = address
            .to_socket_addrs()
            .map_err(|e| anyhow::anyhow!("--metrics {address}: cannot resolve the host ({e}). Give an IP address or a known host name, e.g. 127.0.0.1:9464"))?
            .collect();
        let listener = TcpListener::bind(&addrs[..]).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AddrInUse {
                return anyhow::Error::new(PortInUse(format!("cannot serve metrics on {address}: the port is already in use (another exporter, or another run?). Pick another port, or port 0 for any free one")));
            }
            let why = match e.kind() {
                std::io::ErrorKind::AddrNotAvailable => {
                    "that address is not one of this machine's. Use 127.0.0.1, 0.0.0.0 or an address of this host".to_string()
                }
                std::io::ErrorKind::PermissionDenied => {
                    "permission denied (ports below 1024 need privileges). Pick a port above 1024".to_string()
                }
                _ => e.to_string(),
            };
            anyhow::anyhow!("cannot serve metrics on {address}: {why}")
        })?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new().name("torchmem-metrics".into()).spawn(move || {
            for stream in listener.incoming() {
                if stop2.load(Ordering::Acquire) {
                    break;
                }
                if let Ok(s) = stream {
                    let _ = answer(s, &render);
                }
            }
        })?;
        Ok(MetricsServer { addr, stop, thread: Some(thread) })
    }

    /// The bound address (the real port when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let wake = if self.addr.ip().is_unspecified() {
            SocketAddr::new(
                if self.addr.is_ipv4() { [127, 0, 0, 1].into() } else { std::net::Ipv6Addr::LOCALHOST.into() },
                self.addr.port(),
            )
        } else {
            self.addr
        };
        if TcpStream::connect_timeout(&wake, Duration::from_millis(200)).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// Reads one request's head (up to 16 KiB, 2 s) and answers it.
fn answer(mut stream: TcpStream, render: &Render) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 2048];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 << 10 {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head);
    let mut words = head.lines().next().unwrap_or("").split_whitespace();
    let (method, target) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let accept_openmetrics = head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("accept:") && l.contains("application/openmetrics-text"));
    let (status, body, content_type) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => {
            let (body, ct) = render(accept_openmetrics);
            ("200 OK", body, ct)
        }
        ("GET" | "HEAD", "/") => ("200 OK", "torchmem: metrics at /metrics\n".to_string(), "text/plain; charset=utf-8"),
        ("GET" | "HEAD", _) => {
            ("404 Not Found", "not found: metrics are at /metrics\n".into(), "text/plain; charset=utf-8")
        }
        _ => ("405 Method Not Allowed", "only GET /metrics\n".into(), "text/plain; charset=utf-8"),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if method != "HEAD" {
        out.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&out)?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_are_checked_before_the_run() {
        assert_eq!(parse_listen_address(":9464").unwrap(), "127.0.0.1:9464");
        assert_eq!(parse_listen_address("0.0.0.0:0").unwrap(), "0.0.0.0:0");
        assert_eq!(parse_listen_address("[::1]:9464").unwrap(), "[::1]:9464");
        assert!(parse_listen_address("9464").unwrap_err().contains("no port"));
        assert!(parse_listen_address("localhost:99999").unwrap_err().contains("not a port number"));
        assert_eq!(offset_port("127.0.0.1:9464", 3).unwrap(), "127.0.0.1:9467");
        assert_eq!(offset_port("[::1]:9464", 1).unwrap(), "[::1]:9465");
        assert_eq!(offset_port("0.0.0.0:0", 5).unwrap(), "0.0.0.0:0", "any free port stays any free port");
        let e = offset_port("127.0.0.1:65535", 1).unwrap_err().to_string();
        assert!(e.contains("65535 + local rank 1") && e.contains("past 65535"), "{e}");
    }

    fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn serves_metrics_and_names_a_taken_port() {
        let render: Render = Arc::new(|om| (if om { "om\n# EOF\n" } else { "text\n" }.to_string(), "x/y"));
        let server = MetricsServer::start("127.0.0.1:0", render.clone()).unwrap();
        let addr = server.local_addr();
        let plain = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(plain.starts_with("HTTP/1.1 200 OK\r\n") && plain.ends_with("\r\n\r\ntext\n"), "{plain}");
        let om = get(addr, "GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; version=1.0.0\r\n\r\n");
        assert!(om.ends_with("om\n# EOF\n"), "{om}");
        assert!(get(addr, "GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        let taken = MetricsServer::start(&addr.to_string(), render).err().unwrap();
        assert!(taken.downcast_ref::<PortInUse>().is_some(), "{taken:?}");
        let taken = format!("{taken:#}");
        assert!(taken.contains("already in use") && taken.contains("port 0"), "{taken}");
        drop(server);
        // A process another test forks at that moment holds a copy of the listening socket until its exec:
        // the port is released by then.
        let released = (0..100).any(|_| {
            TcpStream::connect(addr).is_err() || {
                std::thread::sleep(Duration::from_millis(10));
                false
            }
        });
        assert!(released, "the port is released when the server is dropped");
    }
}
