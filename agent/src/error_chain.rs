//! Errors as one line, for logs and the API's messages.

/// An error and its sources on one line ("transport error: connection
/// refused"), each source said once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    with_sources(e.to_string(), e.source())
}

/// `head`, then `first` and its sources, each said once: for an error
/// whose own text is not the best start (a gRPC status's is its message).
pub fn with_sources(head: String, first: Option<&dyn std::error::Error>) -> String {
    let mut s = head;
    let mut cur = first;
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}
