//! The frame codec: a `u32` big-endian body length, then a bincode body.
//!
//! A frame is read whole or not at all; a length over [`FRAME_SIZE_MAX_BYTES`] is refused
//! before anything is allocated, and a body that does not decode (or has trailing bytes)
//! is refused too. Either error closes the connection: after one bad frame the stream
//! position can no longer be trusted.

use bincode::Options;
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::WRITE_BATCH_FRAMES_MAX;

/// Largest frame body, in bytes (the length prefix not included).
pub const FRAME_SIZE_MAX_BYTES: usize = 16 * 1024 * 1024;
/// Size of the length prefix before every frame body, in bytes.
pub const FRAME_HEADER_SIZE_BYTES: usize = 4;

/// Why a frame could not be read or written. Every variant closes the connection.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The frame's body is larger than [`FRAME_SIZE_MAX_BYTES`].
    #[error("frame body of {size_bytes} bytes exceeds the limit of {limit_bytes} bytes")]
    TooLarge {
        /// The body's size, in bytes.
        size_bytes: u64,
        /// The limit, in bytes.
        limit_bytes: usize,
    },
    /// The body is not a valid bincode encoding of the expected message.
    #[error("frame body of {size_bytes} bytes does not decode: {cause}")]
    Undecodable {
        /// The body's size, in bytes.
        size_bytes: usize,
        /// The decoder's error.
        cause: String,
    },
    /// The message could not be encoded.
    #[error("message does not encode: {cause}")]
    Unencodable {
        /// The encoder's error.
        cause: String,
    },
    /// The connection's opening handshake failed: the peer is not a Troupe transport,
    /// speaks another protocol version, or sent a frame out of turn.
    #[error("handshake failed: {cause}")]
    Handshake {
        /// What went wrong.
        cause: String,
    },
    /// The peer closed the connection between two frames.
    #[error("connection closed by the peer")]
    Closed,
    /// Reading or writing the socket failed, or the peer closed it inside a frame.
    #[error("connection failed: {0}")]
    Io(#[from] std::io::Error),
}

/// The one bincode configuration of the wire: varint integers, a size limit, no
/// trailing bytes.
fn wire_options() -> impl Options {
    bincode::DefaultOptions::new().with_limit(FRAME_SIZE_MAX_BYTES as u64)
}

/// Encodes `message` as one frame: length prefix and body.
///
/// # Errors
/// [`FrameError::TooLarge`] if the body exceeds [`FRAME_SIZE_MAX_BYTES`],
/// [`FrameError::Unencodable`] if serialization fails.
pub(crate) fn encode_frame<T: Serialize>(message: &T) -> Result<Bytes, FrameError> {
    // Measured without the limit so an oversized message reports its real size.
    let size = bincode::DefaultOptions::new()
        .serialized_size(message)
        .map_err(|error| FrameError::Unencodable {
            cause: error.to_string(),
        })?;
    let size_bytes = usize::try_from(size).unwrap_or(usize::MAX);
    if size_bytes > FRAME_SIZE_MAX_BYTES {
        return Err(FrameError::TooLarge {
            size_bytes: size,
            limit_bytes: FRAME_SIZE_MAX_BYTES,
        });
    }
    let mut frame = Vec::with_capacity(FRAME_HEADER_SIZE_BYTES + size_bytes);
    let length = u32::try_from(size_bytes).expect("a frame within FRAME_SIZE_MAX_BYTES fits a u32");
    frame.extend_from_slice(&length.to_be_bytes());
    wire_options()
        .serialize_into(&mut frame, message)
        .map_err(|error| FrameError::Unencodable {
            cause: error.to_string(),
        })?;
    assert_eq!(
        frame.len(),
        FRAME_HEADER_SIZE_BYTES + size_bytes,
        "bincode wrote a body of another size than it computed"
    );
    Ok(Bytes::from(frame))
}

/// Reads one whole frame and decodes its body.
///
/// # Errors
/// [`FrameError::Closed`] on a clean end of stream before a frame,
/// [`FrameError::TooLarge`], [`FrameError::Undecodable`], or [`FrameError::Io`] (an end
/// of stream inside a frame is `UnexpectedEof`).
///
/// # Cancel safety
/// Not cancel safe: a cancelled read leaves the stream inside a frame. Cancel it only
/// to abandon the connection.
pub(crate) async fn read_frame<T, R>(reader: &mut R) -> Result<T, FrameError>
where
    T: DeserializeOwned,
    R: AsyncRead + Unpin,
{
    let mut header = [0_u8; FRAME_HEADER_SIZE_BYTES];
    let mut filled = 0;
    while filled < FRAME_HEADER_SIZE_BYTES {
        let read = reader.read(&mut header[filled..]).await?;
        if read == 0 {
            if filled == 0 {
                return Err(FrameError::Closed);
            }
            return Err(FrameError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
        filled += read;
    }
    let length = u32::from_be_bytes(header);
    let size_bytes = usize::try_from(length).unwrap_or(usize::MAX);
    if size_bytes > FRAME_SIZE_MAX_BYTES {
        return Err(FrameError::TooLarge {
            size_bytes: u64::from(length),
            limit_bytes: FRAME_SIZE_MAX_BYTES,
        });
    }
    let mut body = vec![0_u8; size_bytes];
    reader.read_exact(&mut body).await?;
    wire_options()
        .deserialize(&body)
        .map_err(|error| FrameError::Undecodable {
            size_bytes,
            cause: error.to_string(),
        })
}

/// Writes every frame from `frames` to `writer` until the queue closes, flushing after
/// each batch of at most [`WRITE_BATCH_FRAMES_MAX`] frames (madsim's TCP sends only on
/// flush).
///
/// # Errors
/// [`FrameError::Io`] when a write fails; the connection is then broken.
pub(crate) async fn write_frames<W>(writer: &mut W, frames: &mut mpsc::Receiver<Bytes>) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
{
    while let Some(frame) = frames.recv().await {
        writer.write_all(&frame).await?;
        let mut batched = 1;
        while batched < WRITE_BATCH_FRAMES_MAX {
            let Ok(frame) = frames.try_recv() else { break };
            writer.write_all(&frame).await?;
            batched += 1;
        }
        writer.flush().await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_frame_round_trips_and_an_oversized_length_is_refused_unread() {
        let frame = encode_frame(&("hello".to_string(), 7_u64)).unwrap();
        let mut reader: &[u8] = &frame;
        let decoded: (String, u64) = read_frame(&mut reader).await.unwrap();
        assert_eq!(decoded, ("hello".to_string(), 7));
        assert!(matches!(
            read_frame::<(String, u64), _>(&mut reader).await,
            Err(FrameError::Closed)
        ));

        let oversized = u32::MAX.to_be_bytes();
        let mut reader: &[u8] = &oversized;
        assert!(matches!(
            read_frame::<u64, _>(&mut reader).await,
            Err(FrameError::TooLarge { size_bytes, .. }) if size_bytes == u64::from(u32::MAX)
        ));
    }

    #[tokio::test]
    async fn trailing_bytes_and_a_truncated_frame_are_errors() {
        let mut with_trailing = encode_frame(&1_u8).unwrap().to_vec();
        with_trailing[3] += 1;
        with_trailing.push(0xAB);
        let mut reader: &[u8] = &with_trailing;
        assert!(matches!(
            read_frame::<u8, _>(&mut reader).await,
            Err(FrameError::Undecodable { .. })
        ));

        let frame = encode_frame(&"truncated".to_string()).unwrap();
        let mut reader: &[u8] = &frame[..frame.len() - 1];
        assert!(matches!(
            read_frame::<String, _>(&mut reader).await,
            Err(FrameError::Io(_))
        ));
    }
}
