//! The viewer's HTTP server: std::net on 127.0.0.1 only, one thread per connection, every path behind an
//! unguessable token (`/TOKEN/…`, 128 random bits from /dev/urandom, compared in constant time), a strict
//! CSP on every answer, the Host header checked (no DNS rebinding), GET only. Ctrl-C (SIGINT) or SIGTERM
//! ends [`Server::run`] cleanly.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::{api, Doc, PAGE_CSS, PAGE_JS, SERVED_CSP};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// 16 random bytes from /dev/urandom, as 32 hex digits.
pub fn random_token() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Equal strings, in time independent of where they differ.
pub fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses `a=1&b=x%20y`.
pub fn parse_query(s: &str) -> HashMap<String, String> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

/// One HTTP answer.
#[derive(Debug, PartialEq)]
pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

impl Response {
    fn text(status: u16, msg: &str) -> Response {
        Response { status, content_type: "text/plain; charset=utf-8", body: msg.as_bytes().to_vec() }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            403 => "Forbidden",
            404 => "Not Found",
            405 => "Method Not Allowed",
            _ => "Error",
        };
        let mut head = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nContent-Security-Policy: {SERVED_CSP}\r\nX-Content-Type-Options: nosniff\r\nReferrer-Policy: no-referrer\r\nCache-Control: no-store\r\nCross-Origin-Resource-Policy: same-origin\r\nConnection: close\r\n\r\n",
            self.status,
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        head.extend_from_slice(&self.body);
        head
    }
}

/// The answer to one request (method, target, Host header): pure, so the token and CSP rules are unit-tested.
pub fn respond(docs: &[Doc], token: &str, port: u16, method: &str, target: &str, host: Option<&str>) -> Response {
    let host_ok = host.is_some_and(|h| h == format!("127.0.0.1:{port}") || h == format!("localhost:{port}"));
    if !host_ok {
        return Response::text(403, "forbidden: wrong Host");
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let rest = path.strip_prefix('/').unwrap_or("");
    let (tok, rest) = rest.split_once('/').unwrap_or((rest, ""));
    if !same_token(tok.as_bytes(), token.as_bytes()) {
        return Response::text(403, "forbidden: this viewer's URL carries a token; open the URL torchmem printed");
    }
    if method != "GET" {
        return Response::text(405, "GET only");
    }
    match rest {
        "" | "index.html" => Response {
            status: 200,
            content_type: "text/html; charset=utf-8",
            body: crate::page(
                "",
                "<link rel=\"stylesheet\" href=\"viewer.css\">",
                "",
                "<script src=\"viewer.js\"></script>",
            )
            .into_bytes(),
        },
        "viewer.js" => {
            Response { status: 200, content_type: "text/javascript; charset=utf-8", body: PAGE_JS.as_bytes().to_vec() }
        }
        "viewer.css" => {
            Response { status: 200, content_type: "text/css; charset=utf-8", body: PAGE_CSS.as_bytes().to_vec() }
        }
        r if r.starts_with("api/") => match api::handle(docs, &r[4..], &parse_query(query)) {
            Ok(v) => Response {
                status: 200,
                content_type: "application/json",
                body: serde_json::to_vec(&v).unwrap_or_default(),
            },
            Err((status, msg)) => Response::text(status, &msg),
        },
        _ => Response::text(404, "not found"),
    }
}

/// A bound viewer server.
pub struct Server {
    listener: TcpListener,
    token: String,
    docs: Arc<Vec<Doc>>,
}

impl Server {
    /// Binds 127.0.0.1:`port` (0: any free port).
    pub fn bind(docs: Vec<Doc>, port: u16) -> std::io::Result<Server> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], port)))?;
        Ok(Server { listener, token: random_token()?, docs: Arc::new(docs) })
    }

    pub fn port(&self) -> u16 {
        self.listener.local_addr().map(|a| a.port()).unwrap_or(0)
    }

    /// The page's URL, token included.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/{}/", self.port(), self.token)
    }

    /// Serves until SIGINT or SIGTERM (the previous handlers are restored after).
    pub fn run(self) -> std::io::Result<()> {
        STOP.store(false, Ordering::SeqCst);
        let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        let old = unsafe { [libc::signal(libc::SIGINT, handler), libc::signal(libc::SIGTERM, handler)] };
        self.listener.set_nonblocking(true)?;
        let port = self.port();
        while !STOP.load(Ordering::SeqCst) {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let docs = Arc::clone(&self.docs);
                    let token = self.token.clone();
                    std::thread::spawn(move || {
                        let _ = serve_one(stream, &docs, &token, port);
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait_readable(&self.listener, 100),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        // SAFETY: restoring the handlers `signal` returned.
        unsafe {
            libc::signal(libc::SIGINT, old[0]);
            libc::signal(libc::SIGTERM, old[1]);
        }
        Ok(())
    }
}

/// Waits until a connection is pending on `listener` or `ms` milliseconds have passed (so a request is
/// accepted at once, and a signal is noticed within `ms`).
fn wait_readable(listener: &TcpListener, ms: i32) {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut fd, 1, ms) };
}

fn serve_one(mut s: TcpStream, docs: &[Doc], token: &str, port: u16) -> std::io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = s.read(&mut chunk)?;
        if n == 0 || buf.len() > 64 * 1024 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines = text.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let (method, target) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let host = lines
        .take_while(|l| !l.is_empty())
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("host")).map(|(_, v)| v.trim()));
    let r = respond(docs, token, port, method, target, host);
    s.write_all(&r.to_bytes())?;
    s.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_is_random_and_required_everywhere() {
        let a = random_token().unwrap();
        let b = random_token().unwrap();
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        let host = Some("127.0.0.1:8000");
        let ok = respond(&[], &a, 8000, "GET", &format!("/{a}/"), host);
        assert_eq!(ok.status, 200);
        assert!(String::from_utf8_lossy(&ok.body).contains("viewer.js"));
        for target in ["/", "/viewer.js", "/api/meta", &format!("/{b}/api/meta"), &format!("/{}/", &a[..31])] {
            let r = respond(&[], &a, 8000, "GET", target, host);
            assert_eq!(r.status, 403, "{target}");
            assert!(!String::from_utf8_lossy(&r.body).contains(&a));
        }
        // Another Host (DNS rebinding) is refused even with the token.
        assert_eq!(respond(&[], &a, 8000, "GET", &format!("/{a}/"), Some("evil.example:8000")).status, 403);
        assert_eq!(respond(&[], &a, 8000, "GET", &format!("/{a}/"), None).status, 403);
        assert_eq!(respond(&[], &a, 8000, "POST", &format!("/{a}/api/meta"), host).status, 405);
        let meta = respond(&[], &a, 8000, "GET", &format!("/{a}/api/meta"), host);
        assert_eq!(meta.status, 200);
        assert_eq!(meta.content_type, "application/json");
    }

    #[test]
    fn every_answer_carries_the_strict_csp() {
        let r = respond(&[], "t", 1, "GET", "/x/", Some("127.0.0.1:1")).to_bytes();
        let text = String::from_utf8_lossy(&r);
        assert!(text.contains(
            "Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; img-src data:; connect-src 'self'"
        ));
        assert!(text.contains("X-Content-Type-Options: nosniff"));
        // The page loads its script and style as files: nothing inline for the CSP to allow.
        let page = respond(&[], "t", 1, "GET", "/t/", Some("localhost:1"));
        let html = String::from_utf8_lossy(&page.body);
        assert!(
            !html.contains("<script>")
                && !html.contains("<style>")
                && !html.contains("onload=")
                && !html.contains("onclick="),
            "{html}"
        );
    }

    #[test]
    fn queries_are_percent_decoded() {
        let q = parse_query("q=train.py%3A42&doc=1&x=a+b&bad=%zz");
        assert_eq!(q["q"], "train.py:42");
        assert_eq!(q["doc"], "1");
        assert_eq!(q["x"], "a b");
        assert_eq!(q["bad"], "%zz");
    }
}
