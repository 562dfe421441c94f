//! Moving a CRIU image directory over `Peer.TransferImages`.

use std::io::Write;
use std::path::{Path, PathBuf};

use ferry_proto::v1::ImageChunk;

use super::EngineError;

/// Chunk size on the wire: well under tonic's 4 MiB message limit.
pub const IMAGE_CHUNK_BYTES: usize = 1 << 20;

/// Image files are plain names inside the image directory.
pub fn valid_image_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
}

/// Streams every file of `dir` as chunks into `tx`, from a blocking thread;
/// returns (files, bytes).
pub fn read_images(
    dir: PathBuf,
    migration_id: String,
    tx: tokio::sync::mpsc::Sender<ImageChunk>,
) -> Result<(u32, u64), EngineError> {
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .map_err(EngineError::io(format!("listing {}", dir.display())))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().map(|t| t.is_file()).unwrap_or(false))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let (mut files, mut bytes) = (0u32, 0u64);
    for name in names {
        let path = dir.join(&name);
        let mut f = std::fs::File::open(&path)
            .map_err(EngineError::io(format!("opening {}", path.display())))?;
        // Most images are small (one per TCP connection): a buffer the size
        // of the file, not of a chunk, keeps a thousand of them cheap.
        let size = f.metadata().map(|m| m.len() as usize).unwrap_or(0);
        let mut offset = 0u64;
        loop {
            let mut buf = vec![0u8; size.clamp(1, IMAGE_CHUNK_BYTES)];
            let n = read_full(&mut f, &mut buf)
                .map_err(EngineError::io(format!("reading {}", path.display())))?;
            // An empty file still needs one chunk so that it exists there.
            if n == 0 && offset > 0 {
                break;
            }
            buf.truncate(n);
            let chunk = ImageChunk {
                migration_id: migration_id.clone(),
                file_name: name.clone(),
                offset,
                data: buf,
            };
            if tx.blocking_send(chunk).is_err() {
                return Err(EngineError::Internal(
                    "image stream closed by the sender".into(),
                ));
            }
            offset += n as u64;
            bytes += n as u64;
            if n == 0 {
                break;
            }
        }
        files += 1;
    }
    Ok((files, bytes))
}

/// Reads until `buf` is full or the file ends.
fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read;
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Writes incoming chunks into `dir`, checking names and offsets. Blocking
/// (plain file writes on tmpfs): run it off the async runtime.
#[derive(Debug)]
pub struct ImageWriter {
    dir: PathBuf,
    current: Option<(String, std::fs::File, u64)>,
    pub files: u32,
    pub bytes: u64,
}

impl ImageWriter {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_owned(),
            current: None,
            files: 0,
            bytes: 0,
        }
    }

    pub fn write(&mut self, chunk: &ImageChunk) -> Result<(), EngineError> {
        if !valid_image_name(&chunk.file_name) {
            return Err(EngineError::BadImage(format!(
                "file_name {:?} is not a plain file name",
                chunk.file_name
            )));
        }
        let same = matches!(&self.current, Some((n, _, _)) if *n == chunk.file_name);
        if !same {
            if chunk.offset != 0 {
                return Err(EngineError::BadImage(format!(
                    "{}: first chunk at offset {}, expected 0",
                    chunk.file_name, chunk.offset
                )));
            }
            self.finish_file()?;
            let path = self.dir.join(&chunk.file_name);
            let f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| {
                    if e.kind() == std::io::ErrorKind::AlreadyExists {
                        EngineError::BadImage(format!("{} sent twice", chunk.file_name))
                    } else {
                        EngineError::Io {
                            what: format!("creating {}", path.display()),
                            source: e,
                        }
                    }
                })?;
            self.current = Some((chunk.file_name.clone(), f, 0));
            self.files += 1;
        }
        let Some((name, f, written)) = self.current.as_mut() else {
            return Err(EngineError::Internal("no current image file".into()));
        };
        if chunk.offset != *written {
            return Err(EngineError::BadImage(format!(
                "{name}: chunk at offset {}, expected {written}",
                chunk.offset
            )));
        }
        f.write_all(&chunk.data)
            .map_err(EngineError::io(format!("writing {name}")))?;
        *written += chunk.data.len() as u64;
        self.bytes += chunk.data.len() as u64;
        Ok(())
    }

    pub fn finish_file(&mut self) -> Result<(), EngineError> {
        if let Some((name, mut f, _)) = self.current.take() {
            f.flush()
                .map_err(EngineError::io(format!("writing {name}")))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_names_cannot_escape_the_directory() {
        assert!(valid_image_name("pages-1.img"));
        for bad in ["", ".", "..", "../etc/passwd", "a/b", "x\0y"] {
            assert!(!valid_image_name(bad), "{bad:?}");
        }
    }

    #[tokio::test]
    async fn round_trips_a_directory_and_rejects_bad_offsets() {
        let src = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("a.img"), vec![7u8; IMAGE_CHUNK_BYTES + 10]).unwrap();
        std::fs::write(src.path().join("empty.img"), b"").unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::channel(4);
        let dir = src.path().to_owned();
        let reader = tokio::task::spawn_blocking(move || read_images(dir, "m".into(), tx));
        let dst = tempfile::tempdir().unwrap();
        let mut w = ImageWriter::new(dst.path());
        while let Some(c) = rx.recv().await {
            w.write(&c).unwrap();
        }
        w.finish_file().unwrap();
        let (files, bytes) = reader.await.unwrap().unwrap();
        assert_eq!((files, bytes), (2, IMAGE_CHUNK_BYTES as u64 + 10));
        assert_eq!((w.files, w.bytes), (files, bytes));
        assert_eq!(
            std::fs::read(dst.path().join("a.img")).unwrap(),
            std::fs::read(src.path().join("a.img")).unwrap()
        );
        assert!(dst.path().join("empty.img").exists());

        let mut w = ImageWriter::new(dst.path());
        let c = ImageChunk {
            migration_id: "m".into(),
            file_name: "b.img".into(),
            offset: 5,
            data: vec![1],
        };
        assert!(matches!(w.write(&c), Err(EngineError::BadImage(_))));
        let c = ImageChunk {
            migration_id: "m".into(),
            file_name: "../x".into(),
            offset: 0,
            data: vec![1],
        };
        assert!(matches!(w.write(&c), Err(EngineError::BadImage(_))));
    }
}
